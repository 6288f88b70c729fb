# Tandem service image. One image runs any service: the command picks it
# (`tandem serve gateway|router|prefill|gpu-decode|cpu-decode`, or `tandem up` for all in one).
#
#   docker build -t tandem-serve .                                   # CPU torch (default)
#   docker build -t tandem-serve-cuda --build-arg TORCH_INDEX_URL= . # PyPI torch: the CUDA build
#   docker run --rm -p 8000:8000 tandem-serve                        # whole stack, embedded NATS
#   podman build --build-arg BASE=localhost/tandem-base:bookworm ...  # no registry: scripts/compose-check
#
# BASE: any Debian-family image with Python 3.11 as `python` (with venv and ensurepip) and
# useradd; the default is the official slim image.
ARG BASE=python:3.11-slim
FROM ${BASE}

# Where torch==2.13.0 comes from. The default is PyTorch's CPU-only index (a few hundred MB);
# empty means pip's default index, whose Linux wheel is the multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TANDEM_VENV=/opt/tandem/venv \
    TANDEM_CACHE_DIR=/opt/tandem/cache \
    TANDEM_HOST=0.0.0.0 \
    PATH=/opt/tandem/venv/bin:$PATH

# g++ (+ OpenMP): the CPU Q4_0 kernel is compiled on first use (prebuilt below into the cache).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*

# torch in its own layer, so code changes do not download it again (same pin as scripts/setup).
RUN python -m venv "$TANDEM_VENV" \
 && "$TANDEM_VENV/bin/pip" install --upgrade pip \
 && "$TANDEM_VENV/bin/pip" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"

WORKDIR /app
COPY . .

# The same steps as a fresh machine (torch is already there), then build the CPU kernel once.
RUN TORCH_INDEX_URL="$TORCH_INDEX_URL" bash scripts/setup \
 && python -c "import sys; from kernels import cpu; sys.exit(0 if cpu.available() else 'CPU kernel build failed')" \
 && useradd --system --create-home --home-dir /home/tandem tandem \
 && chown -R tandem /opt/tandem/cache \
 && install -d -o tandem -m 0700 /var/lib/tandem/auth \
 && install -d -o tandem /var/lib/tandem/kvpool

USER tandem
EXPOSE 8000
# The gateway listens on every interface (TANDEM_HOST above): give it a key at run time
# (docker run -e TANDEM_API_KEY=... or TANDEM_API_KEYS, docs/security.md). Without one it serves
# anyone and logs a loud warning at start. /var/lib/tandem/auth holds compose's bus credentials
# (`tandem nats-auth`); `tandem up` keeps its own in ~/.cache/tandem.

# A worker that binds the KV data plane on every interface (TANDEM_DATA_HOST=0.0.0.0, as in
# compose.yaml) must advertise an address peers can dial: unless TANDEM_DATA_ADVERTISE_HOST
# is given, use this container's own IP.
ENTRYPOINT ["/bin/sh", "-c", "case \"${TANDEM_DATA_HOST:-}\" in 0.0.0.0|::) if [ -z \"${TANDEM_DATA_ADVERTISE_HOST:-}\" ]; then TANDEM_DATA_ADVERTISE_HOST=\"$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')\"; export TANDEM_DATA_ADVERTISE_HOST; fi;; esac; exec \"$@\"", "tandem-entrypoint"]
CMD ["tandem", "up"]
