"""Installs slime_ext.cpu_runtime (a test and rehearsal aid) at interpreter start when
OPD_CPU_RUNTIME=1; this folder is put on PYTHONPATH by cpu_runtime.runtime_env_vars()."""

import os

if os.environ.get("OPD_CPU_RUNTIME") == "1":
    from slime_ext.cpu_runtime import install

    install()
