"""The OpenAI-compatible front: a separate process (FastAPI + uvicorn) in front of one server's
``ensemble``, talking to it over Triton gRPC (tritonclient's asyncio client).

It is thin: :mod:`.protocol` checks an OpenAI request and maps its fields onto ensemble inputs
(every field this server cannot honour is refused with a 400 naming it), :mod:`.session` runs
one request as a gRPC stream and cancels it when the client goes away, :mod:`.app` serves the
routes and shapes the answers (SSE when streaming). Stop strings, penalties, logprobs, token
counts and finish reasons are features of the stages, so gRPC and HTTP ``generate`` clients get
the same behaviour. Start it with ``scripts/serve.sh`` (``--openai-port``, default 9000) or
``python -m backends.openai --help``.
"""
