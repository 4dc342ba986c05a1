"""Training drafts for a target (`specd distill`): the library behind the command, kept out of the
data plane (`actors/`), which it uses but which never imports it."""
