"""Model families, one module each with its whole spec (config, presets, names and shapes, initial values, checkpoint key maps), and the construction both backends share."""
