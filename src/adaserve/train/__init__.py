"""Training of the shipped default model pair (``adaserve train``).

* ``corpus``    the running interpreter's standard-library source, with a held-out split
* ``tokenizer`` byte-level BPE trained on that corpus
* ``trainer``   time-boxed training of the target, then the draft (CE, then KL distillation)
* ``stats``     draft/target agreement and acceptance measured on held-out prompts
* ``cli``       the ``adaserve train`` command
"""
