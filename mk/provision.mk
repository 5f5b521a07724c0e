# Provisioning: `make provision host=kpro6 [check=1] [inventory=ansible/inventory/kpro6.yml]`
# Runs ansible/playbooks/provision.yml limited to the host and its containers (group
# <host>_containers). check=1 shows what would change (--check --diff) and changes nothing.
ANSIBLE_DIR       := ansible
ANSIBLE_PLAYBOOK  ?= $(VENV)/bin/ansible-playbook
ANSIBLE_LINT      ?= $(VENV)/bin/ansible-lint
PROVISION_ARGS    ?=
inventory         ?= $(ANSIBLE_DIR)/inventory/$(if $(filter localhost,$(host)),local,$(host)).yml

.PHONY: provision provision-syntax provision-lint

provision: venv  ## provision a host and its containers: host=kpro6 [check=1]
	@test -n "$(host)" || { echo "make provision: set host=, e.g. make provision host=kpro6" >&2; exit 2; }
	@$(PY) $(ANSIBLE_DIR)/tools/check_inventory.py --quiet --limit '$(host)' '$(inventory)'
	ANSIBLE_CONFIG=$(ANSIBLE_DIR)/ansible.cfg $(ANSIBLE_PLAYBOOK) -i '$(inventory)' \
	  --limit '$(host):$(host)_containers' $(if $(check),--check --diff) $(PROVISION_ARGS) \
	  $(ANSIBLE_DIR)/playbooks/provision.yml

provision-syntax: venv  ## ansible-playbook --syntax-check
	@for inv in $(ANSIBLE_DIR)/inventory/*.yml; do \
	  ANSIBLE_CONFIG=$(ANSIBLE_DIR)/ansible.cfg $(ANSIBLE_PLAYBOOK) -i $$inv --syntax-check $(ANSIBLE_DIR)/playbooks/provision.yml || exit 1; \
	done

provision-lint: venv  ## ansible-lint
	cd $(ANSIBLE_DIR) && $(abspath $(ANSIBLE_LINT)) -q
