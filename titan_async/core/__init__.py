"""What every other package may import, and which imports none of them: the error that reaches
the user as one line (`errors`), the adaptation of torchtitan to the machine (`platform`) and the
per-rank communication log (`comm_log`)."""
