"""The job: its config (pydantic sections read from YAML), the slime flags it owns, and the
assembly of its parts from it (harness, runner settings, hint and reminder contexts,
sandboxes). Everything that runs a job imports this floor: the CLI and plans (launch), the
slime hooks and the embedded trainer; it imports none of them."""
