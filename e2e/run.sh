#!/usr/bin/env bash
# End-to-end run on a throwaway kind cluster (a laptop with Docker and kind is enough; no GPU):
#   1. create the kind cluster (or reuse it),
#   2. build the operator and engine images from Dockerfile.operator / Dockerfile.engine and load them into it,
#   3. run e2e/ with pytest: helm install charts/shoal, apply manifests/examples/cpu-demo.yaml, wait for Ready
#      through the InferenceService status, port-forward the gateway Service, call it with the openai client,
#   4. delete the cluster (unless SHOAL_E2E_KEEP=1).
#
#   e2e/run.sh                       # everything
#   e2e/run.sh -k openai             # extra arguments go to pytest
#
# Environment:
#   SHOAL_E2E_CLUSTER         kind cluster name                       (default shoal-e2e)
#   SHOAL_E2E_TAG             image tag                               (default e2e)
#   SHOAL_E2E_SKIP_BUILD=1    reuse shoal-operator:TAG and shoal-engine:TAG already in the local Docker
#   SHOAL_E2E_ENGINE_BUILD_ARGS  extra `docker build` arguments for the engine image, e.g.
#                             "--build-arg TORCH_INDEX_URL=<a CPU-only torch index>" for a much smaller image
#   SHOAL_E2E_KEEP=1          keep the cluster, the release and the demo for inspection
#   PYTHON                    Python with the test extras installed   (default .venv/bin/python, else python3)
# Needs: docker, kind, kubectl; helm is optional (the tests fall back to helm-python-sdk).
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER="${SHOAL_E2E_CLUSTER:-shoal-e2e}"
TAG="${SHOAL_E2E_TAG:-e2e}"
OPERATOR_IMAGE="shoal-operator:${TAG}"
ENGINE_IMAGE="shoal-engine:${TAG}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

log() { printf '\n==> %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { echo "e2e/run.sh: '$1' is required" >&2; exit 2; }; }
need docker
need kind
need kubectl

KUBECONFIG_FILE="$(mktemp -t shoal-e2e-kubeconfig.XXXXXX)"
cleanup() {
  local rc=$?
  if [ "${SHOAL_E2E_KEEP:-0}" = "1" ]; then
    log "keeping kind cluster '${CLUSTER}' (kind delete cluster --name ${CLUSTER}); kubeconfig: ${KUBECONFIG_FILE}"
  else
    log "deleting kind cluster '${CLUSTER}'"
    kind delete cluster --name "${CLUSTER}" >/dev/null 2>&1 || true
    rm -f "${KUBECONFIG_FILE}"
  fi
  exit "$rc"
}
trap cleanup EXIT

if kind get clusters 2>/dev/null | grep -qx "${CLUSTER}"; then
  log "reusing kind cluster '${CLUSTER}'"
else
  log "creating kind cluster '${CLUSTER}'"
  kind create cluster --name "${CLUSTER}" --wait 180s
fi
kind get kubeconfig --name "${CLUSTER}" > "${KUBECONFIG_FILE}"
export KUBECONFIG="${KUBECONFIG_FILE}"

if [ "${SHOAL_E2E_SKIP_BUILD:-0}" != "1" ]; then
  log "building ${OPERATOR_IMAGE}"
  docker build -f Dockerfile.operator -t "${OPERATOR_IMAGE}" .
  log "building ${ENGINE_IMAGE}"
  # shellcheck disable=SC2086  # word splitting of the extra arguments is intended
  docker build -f Dockerfile.engine -t "${ENGINE_IMAGE}" ${SHOAL_E2E_ENGINE_BUILD_ARGS:-} .
fi

log "loading images into '${CLUSTER}'"
kind load docker-image --name "${CLUSTER}" "${OPERATOR_IMAGE}" "${ENGINE_IMAGE}"

log "running e2e tests"
SHOAL_E2E=1 \
SHOAL_E2E_OPERATOR_IMAGE="${OPERATOR_IMAGE}" \
SHOAL_E2E_ENGINE_IMAGE="${ENGINE_IMAGE}" \
  "${PYTHON}" -m pytest e2e -v -rs "$@"
