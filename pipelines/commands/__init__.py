"""The CLI (`distill COMMAND`) and what each command runs: run, validate, plan, eval, prepare,
generate; thin entry points over the loop and its parts."""
