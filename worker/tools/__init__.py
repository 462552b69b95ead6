"""Tool calls: which call markup a model's family writes, the parsers that read calls out of an output, and the
grammars that constrain a call to the family's markup around each function's parameters schema.

Owns: the family, told from the chat template (families.py), one pure parser per family (parsers.py), and the
llguidance grammar of a constrained call (grammar.py). The engine's use of them is worker/extras/chat.py's.
"""
