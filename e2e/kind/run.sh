#!/usr/bin/env bash
# The local-control-plane scenarios against a real cluster: kind by default, or any cluster in the current
# kubeconfig context with --use-current-context (then the images must be pullable by its nodes: push them
# and pass --engine-image/--operator-image).
#
#   e2e/kind/run.sh                      # kind cluster "ember", images built here and loaded into it
#   e2e/kind/run.sh --keep               # leave the cluster and the resources for a look around
#   e2e/kind/run.sh --cluster NAME       # the kind cluster NAME instead (created if missing; not with
#                                        # --use-current-context, which uses no kind cluster)
#   e2e/kind/run.sh --use-current-context --engine-image REG/ember-engine:TAG --operator-image REG/ember-operator:TAG
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cluster=ember
engine_image=ghcr.io/ember-dev/ember-engine:dev
operator_image=ghcr.io/ember-dev/ember-operator:dev
use_current=0
keep=0
ns=ember-e2e

while [ $# -gt 0 ]; do
  case "$1" in
    --use-current-context) use_current=1 ;;
    --keep) keep=1 ;;
    --cluster) cluster=$2; shift ;;
    --engine-image) engine_image=$2; shift ;;
    --operator-image) operator_image=$2; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

step() { printf '\n== %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "needs $1 on PATH" >&2; exit 1; }; }
need kubectl
need curl

if [ "$use_current" = 0 ]; then
  need docker
  need kind
  step "images"
  docker build -f "$repo/Dockerfile.engine" -t "$engine_image" "$repo"
  docker build -f "$repo/Dockerfile.operator" -t "$operator_image" "$repo"
  step "kind cluster $cluster"
  kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
  kubectl config use-context "kind-$cluster"
  kind load docker-image --name "$cluster" "$engine_image" "$operator_image"
fi

cleanup() {
  if [ "$keep" = 0 ]; then
    kubectl delete namespace "$ns" --ignore-not-found --wait=false
  fi
}
trap cleanup EXIT

step "operator"
overlay=$(mktemp -d)
cp -r "$repo/manifests/base" "$overlay/base"
cat > "$overlay/kustomization.yaml" <<YAML
resources: [base]
images:
  - name: ghcr.io/ember-dev/ember-operator
    newName: ${operator_image%:*}
    newTag: ${operator_image##*:}
YAML
kubectl apply -f "$repo/crds/"
kubectl wait --for condition=established --timeout=60s crd/inferenceservices.ember.dev
kubectl apply -k "$overlay"
kubectl -n ember-system rollout status deployment/ember-operator --timeout=180s

step "a tiny test checkpoint in a PersistentVolumeClaim (the cluster's default StorageClass)"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$ns" apply -f - <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: model-weights}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
apiVersion: batch/v1
kind: Job
metadata: {name: make-test-model}
spec:
  backoffLimit: 2
  template:
    spec:
      restartPolicy: Never
      securityContext: {fsGroup: 10001}
      containers:
        - name: make
          image: $engine_image
          imagePullPolicy: IfNotPresent
          command: [ember, make-test-model, /models/tiny, --size, tiny, --force]
          volumeMounts: [{name: models, mountPath: /models}]
      volumes: [{name: models, persistentVolumeClaim: {claimName: model-weights}}]
YAML
kubectl -n "$ns" wait --for=condition=complete --timeout=300s job/make-test-model

step "apply examples/local.yaml with this engine image"
sed -e "s|    gpus: 0|    gpus: 0\n    image: $engine_image\n    imagePullPolicy: IfNotPresent|" \
  "$repo/examples/local.yaml" | kubectl -n "$ns" apply -f -
kubectl -n "$ns" wait --for=condition=Ready --timeout=600s inferenceservice/tiny
kubectl -n "$ns" wait --for=condition=WarmPoolReady --timeout=600s inferenceservice/tiny
kubectl -n "$ns" get inferenceservices

step "a chat completion through the Service"
kubectl -n "$ns" port-forward service/tiny 18080:80 >/dev/null 2>&1 &
forward=$!
trap 'kill $forward 2>/dev/null; cleanup' EXIT
for _ in $(seq 50); do curl -fsS http://127.0.0.1:18080/v1/models >/dev/null 2>&1 && break; sleep 0.2; done
curl -fsS http://127.0.0.1:18080/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'
echo

step "a policy change restarts nothing"
before=$(kubectl -n "$ns" get pods -l app.kubernetes.io/instance=tiny -o name | sort)
kubectl -n "$ns" patch inferenceservice tiny --type merge -p '{"spec": {"loadShedding": {"maxQueueDepth": 4}}}'
for _ in $(seq 60); do
  kubectl -n "$ns" get configmap tiny-policy -o jsonpath='{.data.policy\.yaml}' | grep -q 'maxQueueDepth: 4' && break
  sleep 1
done
kubectl -n "$ns" get configmap tiny-policy -o jsonpath='{.data.policy\.yaml}' | grep -q 'maxQueueDepth: 4'
after=$(kubectl -n "$ns" get pods -l app.kubernetes.io/instance=tiny -o name | sort)
[ "$before" = "$after" ] || { echo "pods changed on a policy-only edit" >&2; exit 1; }

step "scale through the scale subresource (External mode)"
kubectl -n "$ns" patch inferenceservice tiny --type merge -p '{"spec": {"autoscaling": {"mode": "External"}}}'
kubectl -n "$ns" scale inferenceservice tiny --replicas=2
for _ in $(seq 180); do
  [ "$(kubectl -n "$ns" get inferenceservice tiny -o jsonpath='{.status.readyReplicas}')" = 2 ] && break
  sleep 1
done
[ "$(kubectl -n "$ns" get inferenceservice tiny -o jsonpath='{.status.readyReplicas}')" = 2 ]

step "delete: every child garbage-collected"
kubectl -n "$ns" delete inferenceservice tiny --wait=true --timeout=120s
for _ in $(seq 120); do
  [ -z "$(kubectl -n "$ns" get pods,services,configmaps -l app.kubernetes.io/instance=tiny -o name)" ] && break
  sleep 1
done
[ -z "$(kubectl -n "$ns" get pods,services,configmaps -l app.kubernetes.io/instance=tiny -o name)" ]

step "all scenarios passed"
