"""The learner: the model, its data, the jitted inner AdamW step, and the training thread."""
