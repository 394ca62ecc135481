"""Copy model_repository to a new directory, rewriting stage parameters and instance counts.

    python scripts/make_repo.py --out /tmp/repo --model models/smollm2-135m-instruct \\
        --set decode.max_batch=8 --set num_pages=256 --instances prefill=2
    python scripts/make_repo.py --out /tmp/repo --set spec_enabled=true --set spec_tokens=3
    python scripts/make_repo.py --out /tmp/repo --prefill-gpus 0,1 --decode-gpus 2,3

``--set stage.param=value`` changes one stage; ``--set param=value`` every stage that uses the
parameter (backends/stages/params.py says which; an unknown name is an error). ``--model DIR``
sets ``model_dir`` everywhere (made absolute). ``--prefill-gpus 0,1`` / ``--decode-gpus 2,3``
place a stage on GPUs: its ``instance_group`` becomes ``KIND_GPU`` with those GPUs, one instance
per GPU (times ``--instances``), and ``device: auto`` (the default) runs each on its own GPU;
with ``tensor_parallel_size`` N, each N consecutive GPUs are one instance's ranks.
Values are checked with the same parser the stages use at load, so a repository that make_repo
writes loads.

``--role`` picks the models of one server of a deployment: ``all`` (default) the single server
(no router); ``prefill`` only the prefill model (a prefill server); ``decode`` the client-facing
ensemble whose prefill step is the ``router`` model, forwarding to ``--set
prefill_servers=HOST:GRPC_PORT,...`` (a decode server).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

from backends.stages.params import SCHEMA, STAGES, parse_params, stages_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SRC = os.path.join(ROOT, "model_repository")
ROLES = {  # the models each server role serves
    "all": ("preprocess", "prefill", "decode", "postprocess", "ensemble"),
    "prefill": ("prefill",),
    "decode": ("preprocess", "router", "decode", "postprocess", "ensemble"),
}
_PARAM = r'(parameters:\s*\{{\s*key:\s*"{}"\s*value:\s*\{{\s*string_value:\s*")([^"]*)(")'


def read_params(text: str) -> dict[str, str]:
    pat = r'parameters:\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"'
    return {m.group(1): m.group(2) for m in re.finditer(pat, text)}


def set_param(text: str, name: str, value: str) -> str:
    if '"' in value or "\n" in value:
        raise SystemExit(f"parameter {name}: value must not contain quotes or newlines")
    pat = re.compile(_PARAM.format(re.escape(name)))
    if pat.search(text):
        return pat.sub(lambda m: m.group(1) + value + m.group(3), text)
    line = f'parameters: {{ key: "{name}" value: {{ string_value: "{value}" }} }}\n'
    return text.rstrip("\n") + "\n" + line


def set_instances(text: str, count: int) -> str:
    new, n = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", rf"\g<1>{count}", text)
    if n != 1:
        raise SystemExit("config has no single instance_group to change")
    return new


def set_gpus(text: str, gpus: list[int]) -> str:
    """Make the single instance_group KIND_GPU on ``gpus`` (keeping its count per GPU)."""
    pat = r"instance_group\s*\[\s*\{\s*count:\s*(\d+)\s*,\s*kind:\s*KIND_\w+[^}]*\}\s*\]"
    listed = ", ".join(str(g) for g in gpus)
    new, n = re.subn(
        pat,
        lambda m: (
            f"instance_group [ {{ count: {m.group(1)}, kind: KIND_GPU, gpus: [ {listed} ] }} ]"
        ),
        text,
    )
    if n != 1:
        raise SystemExit("config has no single instance_group to place on GPUs")
    return new


def parse_gpus(spec: str, flag: str) -> list[int]:
    """``"0,1"`` -> [0, 1]; SystemExit naming the flag otherwise."""
    try:
        gpus = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {spec!r}: expected GPU indices like 0,1") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise SystemExit(f"{flag} {spec!r}: expected distinct GPU indices like 0,1")
    return gpus


def rank_gpus(gpus: list[int], tp: int, flag: str) -> list[int]:
    """With ``tensor_parallel_size`` N, every N consecutive GPUs of the list are one instance's
    ranks (rank 0 on the first, which Triton gives the instance): [0, 1, 2, 3] at N = 2 ->
    instances on 0 and 2. SystemExit unless the list is whole groups of consecutive GPUs."""
    groups = [gpus[i : i + tp] for i in range(0, len(gpus), tp)]
    if len(gpus) % tp or any(g != list(range(g[0], g[0] + tp)) for g in groups):
        raise SystemExit(f"{flag} {gpus}: tensor_parallel_size {tp} needs groups of {tp}"
                         " consecutive GPUs, one per instance (e.g. 0,1,2,3 for 2)")  # fmt: skip
    return [g[0] for g in groups]


def apply_role(out: str, role: str) -> None:
    """Keep the models of ``role``; a decode server's ensemble calls the router for prefill."""
    if role not in ROLES:
        raise SystemExit(f"--role {role!r}: expected one of {sorted(ROLES)}")
    for name in os.listdir(out):
        if os.path.isdir(os.path.join(out, name)) and name not in ROLES[role]:
            shutil.rmtree(os.path.join(out, name))
    if role == "decode":
        path = os.path.join(out, "ensemble", "config.pbtxt")
        text = open(path).read()
        new, n = re.subn(r'model_name:\s*"prefill"', 'model_name: "router"', text)
        if n != 1:
            raise SystemExit("ensemble config has no single prefill step to route")
        with open(path, "w") as f:
            f.write(new)


def make_repo(
    out: str,
    model: str | None = None,
    sets=(),
    instances=(),
    src: str = SRC,
    gpus: dict[str, list[int]] | None = None,
    role: str = "all",
) -> str:
    if os.path.abspath(out) == os.path.abspath(src):
        raise SystemExit("--out must differ from the source repository")
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"))
    apply_role(out, role)
    present = [s for s in STAGES if os.path.isdir(os.path.join(out, s))]
    configs = {s: open(os.path.join(out, s, "config.pbtxt")).read() for s in present}
    changes: list[tuple[str | None, str, str]] = []
    if model:
        changes.append((None, "model_dir", os.path.abspath(model)))
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected [stage.]param=value")
        stage, _, name = key.rpartition(".")
        if stage and stage not in STAGES:
            raise SystemExit(f"--set {item!r}: stage must be one of {STAGES}")
        changes.append((stage or None, name, value))
    for stage, name, value in changes:
        if name not in SCHEMA:
            raise SystemExit(f"--set {name}: unknown parameter; known: {sorted(SCHEMA)}")
        targets = [stage] if stage else list(stages_of(name))
        for s in [t for t in targets if t in configs]:  # stages of other server roles: skip
            configs[s] = set_param(configs[s], name, value)
    for item in instances:
        stage, _, n = item.partition("=")
        if stage not in STAGES or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--instances {item!r}: expected STAGE=N with N >= 1")
        if stage not in configs:
            continue
        configs[stage] = set_instances(configs[stage], int(n))
    rp = parse_params(read_params(configs["router"])) if role == "decode" else None
    if rp and not (
        rp.prefill_servers or rp.local_prefill_max_tokens or rp.local_prefill_busy_tokens
    ):
        raise SystemExit(
            "--role decode needs --set prefill_servers=HOST:GRPC_PORT[,...] (or local prefill)"
        )
    for stage, ids in (gpus or {}).items():
        if stage not in configs:
            continue
        tp = parse_params(read_params(configs[stage]), stage).tensor_parallel_size
        configs[stage] = set_gpus(configs[stage], rank_gpus(ids, tp, f"--{stage}-gpus"))
    for s, text in configs.items():
        try:
            parse_params(read_params(text), s)
        except ValueError as e:
            raise SystemExit(f"{s}: {e}") from None
        with open(os.path.join(out, s, "config.pbtxt"), "w") as f:
            f.write(text)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to create (replaced if it exists)")
    ap.add_argument("--src", default=SRC, help="repository to copy (default: model_repository)")
    ap.add_argument("--model", help="checkpoint directory for every stage")
    ap.add_argument("--set", action="append", default=[], metavar="[STAGE.]PARAM=VALUE")
    ap.add_argument("--instances", action="append", default=[], metavar="STAGE=N")
    ap.add_argument("--prefill-gpus", metavar="0,1", help="place prefill on these GPUs")
    ap.add_argument("--decode-gpus", metavar="2,3", help="place decode on these GPUs")
    ap.add_argument("--role", default="all", choices=sorted(ROLES), help="server role")
    args = ap.parse_args(argv)
    gpus = {
        stage: parse_gpus(spec, f"--{stage}-gpus")
        for stage, spec in (("prefill", args.prefill_gpus), ("decode", args.decode_gpus))
        if spec
    }
    print(make_repo(args.out, args.model, args.set, args.instances, args.src, gpus, args.role))
    return 0


if __name__ == "__main__":
    sys.exit(main())
