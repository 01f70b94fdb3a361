"""Adapters that put kt's routed experts into other programs (trainers,
servers). Each submodule imports its host lazily, so `import kt` and
`import kt.integrations` never need them installed."""
