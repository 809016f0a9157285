"""Test fixtures the tests, the demo and the benchmarks share: tiny random-weight pipelines of every family, built
offline (``tiny_models``), and tiny random LoRAs for them in every layout LoRAs are published in (``tiny_loras``).
Each family names its builder (``FamilyAdapter.make_tiny_model``); nothing of the runtime
imports this package."""
