"""turnstream's CPU inference engine: the subset of SGLang's HTTP API the rest of turnstream uses."""
