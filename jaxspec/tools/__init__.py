"""The command-line tools as installed: `checkpoints_convert`, `infer` and `train` (the
repository's folders of those names) live here in an installed jaxspec, so that they never
take those top-level names from a user's own modules."""
