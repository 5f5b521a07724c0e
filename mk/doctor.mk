# `make doctor [job=stage1] [preset=tiny]`: the preflight table for this machine (see launch/doctor/README.md).
.PHONY: doctor
doctor: venv  ## the preflight table for this machine [job=stage1] [preset=tiny]
	$(LAUNCH) doctor $(if $(job),--job $(job)) $(if $(preset),--preset $(preset))
