"""The training loop and everything one optimizer step needs: data order, batch split, optimizer,
precision, communication hooks, preemption and hang guards, process groups.
"""
