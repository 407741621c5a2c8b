"""`transformers` VLMs trained on packs: built from a config sized by the dataset's conventions and the model's
flavor (`build`), cut into the trainer's flat layer list for pipelines (`model`, its layers in `layers`), fed a
step's packs padded to one shape (`inputs`); or run whole, one pack at a time, at pp=1 (`whole`)."""
