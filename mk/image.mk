# Container images: `make image [name=trainer] [flavour=cpu|gpu|test] [force=1]` (as root).
# Builds build/images/<name>-<flavour>/<name>-<flavour>_<hash>_amd64.tar.zst and its
# manifest.json; returns in seconds when the inputs hash equals the last build's (images/README.md).
IMAGE_OUT ?= build/images

.PHONY: image test-image

image: venv
	$(PY) -m images.build --name $(or $(name),trainer) --flavour $(or $(flavour),cpu) \
	  --out $(IMAGE_OUT) $(if $(force),--force)

test-image: venv
	$(PY) -m pytest -q tests/test_image.py
