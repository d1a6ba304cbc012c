"""The device-resident paged KV cache: page geometry and allocator (`pages`), device pages and
per-request page tables (`paged`), prefix-cache keys (`prefix`). The programs that read and write the pages are in
`models/paged.py` and reached through `models.Model` (`paged_decode_step`, `prefill_chunk`,
`write_prefill_pages`)."""
from .paged import H2D_CAUSES, PagedKVCache, bucket_pages, kv_bytes_per_token
from .pages import NULL_PAGE, OutOfPages, PageAllocator, PageConfig
from .prefix import prefix_namespace

__all__ = ["H2D_CAUSES", "NULL_PAGE", "OutOfPages", "PageAllocator", "PageConfig", "PagedKVCache", "bucket_pages",
           "kv_bytes_per_token", "prefix_namespace"]
