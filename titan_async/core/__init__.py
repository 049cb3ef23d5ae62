"""What every other package may import, and which imports none of them: the error that reaches
the user as one line (`errors`) and the adaptation of torchtitan to the machine (`platform`)."""
