"""Triton kernels of Kimi Delta Attention: the chunk kernels (:mod:`.chunk`, :mod:`.chunk_fwd`,
:mod:`.chunk_bwd`) and the token-recurrent kernels with their backward (:mod:`.recurrent`)."""
