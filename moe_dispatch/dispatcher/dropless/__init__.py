"""The dropless plan (``DroplessPlan``, plan.py): every step's sizes from one size exchange
(layout.py: one all-gather, one host read, which also validates every rank's input), then the
kind's forward exchange and the unreduced return to the owners (exchange.py). Nothing is dropped;
buffers are sized exactly. The sync-free plan's first step at EP > 1 runs this size exchange too."""
