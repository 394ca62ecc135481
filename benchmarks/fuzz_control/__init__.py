"""The control-plane fuzzer (``python -m benchmarks.fuzz_control``): ``run`` drives the attacked
processes and gives the verdict, ``frames`` draws the malformed and hostile frames."""
