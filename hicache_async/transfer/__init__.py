"""The worker side: the threads and streams that move pages (copier, completion events, page
store), the pools they move between, the stored object format and its checksums.
"""
