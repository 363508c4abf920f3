"""The drafter room: its networks and kinds. `config` (DrafterConfig, the official config.json) and
`config_format` (its keys, layer types, what the engines would serve differently), `network` (the
DFlash drafter: one forward for training, the eval walk and decoding; the export), `kinds` (the
drafter-kind registry and one module per kind)."""
