# Container images: `make image [name=trainer] [flavour=cpu|gpu|test] [force=1] [lxc_xz=1]` (as root).
# Builds build/images/<name>-<flavour>/<name>-<flavour>_<hash>_amd64.tar.zst, its LXC metadata
# and manifest.json; returns in seconds when the inputs hash equals the last build's (images/README.md).
# `make wheelhouse flavour=cpu|gpu [wheels=DIR] [os=ubuntu-24.04 | python=3.12 glibc=2.39] [lock=FILE]`:
# the flavour's wheels, resolved with this machine's pip, into build/wheelhouse/<flavour>/ (make
# image does it too when needed), or for a container's own Python into <flavour>-cpNNN/.
IMAGE_OUT ?= build/images

.PHONY: image wheelhouse test-image lock-check

image: venv  ## build a container image [name=trainer] [flavour=cpu|gpu|test] (as root)
	$(PY) -m images.build --name $(or $(name),trainer) --flavour $(or $(flavour),cpu) \
	  --out $(IMAGE_OUT) $(if $(force),--force) $(if $(lxc_xz),--lxc-xz)

wheelhouse: venv  ## a flavour's wheels into build/wheelhouse/ (os=ubuntu-24.04 or python=/glibc= for a container's OS)
	$(PY) -m images.make_wheelhouse --name $(or $(name),trainer) --flavour $(or $(flavour),cpu) $(if $(wheels),--add $(wheels)) \
	  $(if $(os),--os $(os)) $(if $(python),--python $(python)) $(if $(glibc),--glibc $(glibc)) $(if $(lock),--lock $(lock))

test-image: venv  ## the image tests
	$(PY) -m pytest -q tests/test_image.py

lock-check: venv  ## each GPU lock's kernel pins resolve for its Python (pip --dry-run, cp311 and cp312)
	$(PY) -m images.check_locks
