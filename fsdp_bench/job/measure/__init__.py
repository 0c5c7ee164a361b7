"""What a run measures besides its loss: the timed steps, collectives, memory and its
timeline, where a step's time goes, checkpoint cost, the machine's load, peak FLOP/s for MFU."""
