"""From what users have (catalogue names, config.json, DeepSpeed JSON, ColossalAI configs, GPU presets, command-line values) to validated specs, and back to engine configs."""
