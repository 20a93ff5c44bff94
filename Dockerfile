# dsuf server image: the repository, its Python requirements and the CUDA 13 runtime.
#
#   docker build -t dsuf:latest .
#   docker run --gpus all -p 8000:8000 -v /models:/models:ro dsuf:latest \
#       --host 0.0.0.0 --ckpt /models/DeepSeek-V4.1-Flash --gpus 0,1,2,3,4,5,6,7
#
# Without arguments it serves the embedded demo model on the CPU (numpy backend).
# CuPy compiles kernels/*.cu at run time through NVRTC (the nvidia-cuda-nvrtc wheel), so the
# runtime image is enough: no CUDA toolkit.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python3-pyverbs and ibverbs-providers: RDMA state transfers (kvcache/transport_rdma.py loads
# pyverbs from Debian's dist-packages); without an RDMA device the server uses TCP.
# (versions: those of the pinned base image's Ubuntu release)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pyverbs ibverbs-providers \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY . .
RUN useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin dsuf
USER 10001

# 8000: the OpenAI API, /health, /readyz, /metrics; 7000: state transfers between servers
EXPOSE 8000 7000
# /health is 200 while the process runs (loading included); readiness is GET /readyz
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["python3", "dsuf.py", "serve"]
# inside a container, listen on every address (the default, localhost, is unreachable from outside)
CMD ["--host", "0.0.0.0", "--port", "8000"]
