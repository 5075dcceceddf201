"""Prefill/decode disaggregation with remote partial fetch of KV blocks (issue 10).

Who owns what:
  transfer.py  the NIXL agent (UCX): registered host memory, one-sided READs, release notifications
  export.py    prefill side: PrefillEngine keeps a finished prompt's KV blocks and summaries for the
               decode instance (KVExporter) until it reports the request done, or a timeout
  local.py     decode side: LocalChunks, the decode's own host memory, chunk by chunk (spilled tails
               and a bounded cache of remote chunks)
  remote.py    decode side: RemoteOasisPolicy, oasis whose host store is remote, fetched per chunk
  decode.py    decode side: DecodeEngine admits a request prefilled elsewhere
  server.py    `oasiskv serve --role prefill|decode`: the engines behind the usual HTTP server
  proxy.py     `oasiskv proxy`: prefill first, then decode, streaming passed through
"""
