"""mixprec: reproduce what mixed precision buys in speed, memory and accuracy."""
__version__ = "0.1.0"
