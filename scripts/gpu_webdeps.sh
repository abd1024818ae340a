# Sourced by the GPU scripts: the device image has no web stack (fastapi, uvicorn, httpx, ...).
# They travel as wheels in .gpuwheels (ignored by git; the download command is in
# docs/BENCHMARKS.md, "How to reproduce on a GPU machine") and are installed here, with
# --no-deps, beside the image's torch and numpy.
if [ -d .gpuwheels ]; then
  python -m pip install -q --no-deps --no-index --target /tmp/webdeps .gpuwheels/*.whl 2>&1 | grep -v WARNING | tail -3
  export PYTHONPATH=$PWD:/tmp/webdeps
else
  export PYTHONPATH=$PWD
fi
