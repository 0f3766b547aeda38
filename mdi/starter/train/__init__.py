"""mdi-train on the starter's side: a LoRA (or a soft prompt) trained through the ring while
the base stays frozen on the boards that hold it. The driver (training), one step's frames
through the ring (ring_trainer), its data (train_data), what a run is asked and gives back
(train_options), its checkpoints (train_checkpoint) and a run through a lost worker
(train_recovery). The package is `train`, not `training`: the driver module kept its name
`mdi.starter.train.training` working (mdi.old_paths maps it here), which a package of that name
would have hidden.
"""
