"""The generated tasks' word pools (TRAIN, HELD_OUT), filler and passcodes: they live in
`workbench.retrieval_text`, so the workbench's demo asks the trained model in the wording it was
trained on without importing `training`; this module keeps the training package's own name for them."""

from workbench.retrieval_text import HELD_OUT, TRAIN, World, filler, value_string

__all__ = ["HELD_OUT", "TRAIN", "World", "filler", "value_string"]
