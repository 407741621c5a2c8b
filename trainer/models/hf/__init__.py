"""`transformers` VLMs trained on packs: built from a config sized by the dataset's conventions (`build`), cut
into the trainer's flat layer list (`model`, its layers in `layers`), fed a step's packs padded to one shape
(`inputs`)."""
