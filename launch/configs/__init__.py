"""Example job configs: `opd config validate` each one."""
