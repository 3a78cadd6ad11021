# turnstream developer entry points. Heavy installs live in ~/.cache/turnstream (TURNSTREAM_CACHE).
.PHONY: setup run test lint format services-up services-down rehearse rehearse-k8s clean

setup:            ## venvs (cached by lock hash: the services', SGLang's), Kafka jars, redis-server
	bash scripts/setup-venv.sh
	bash scripts/setup-sglang.sh
	bash scripts/kafka.sh install
	bash scripts/redis.sh install
	bash scripts/chromium.sh install
	bash scripts/openclaw.sh install
	bash scripts/agents.sh install

run:              ## set up and run the main job on the embedded defaults
	bash scripts/run.sh

test:             ## set up and run lint + the whole test suite (real Kafka and Redis)
	bash scripts/test.sh

rehearse:         ## the GPU-host compose deployment in real containers on this CPU machine (docs/gpu-host.md)
	bash scripts/rehearse.sh

rehearse-k8s:     ## the Helm chart on a real single-node Kubernetes built here (docs/kubernetes.md)
	bash scripts/rehearse-k8s.sh

lint:             ## ruff (checks, formatting) and mypy (schemas/, runtime/, services/)
	bash scripts/setup-venv.sh
	bash scripts/lint.sh

format:
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

services-up:      ## Kafka on 127.0.0.1:9092 and Redis on 127.0.0.1:6379, left running
	bash scripts/kafka.sh start
	bash scripts/redis.sh start

services-down:
	bash scripts/kafka.sh stop
	bash scripts/redis.sh stop

clean:
	rm -rf .venv .pytest_cache .hypothesis .ruff_cache .mypy_cache
