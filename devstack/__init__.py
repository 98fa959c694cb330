"""Development launchers: `remp up` (the whole stack on one machine), the process launchers
the tests and benchmarks use, and the tiny random Llama."""
