# The operator image: cachewarm and its dependencies, no jax (warmers run in the
# training image). Build: docker build -t cachewarm/operator:0.1.0 .
# PYTHON_IMAGE: the base (a python 3.11 with pip); the testbed builds from a local Debian
# one (cachewarm_testbed.images), since no registry is reachable there.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
RUN useradd --uid 65532 --create-home --shell /usr/sbin/nologin cachewarm
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 65532:65532
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["cachewarm"]
CMD ["run"]
