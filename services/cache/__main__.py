"""``python -m services.cache``: run the cache service."""

from services.cache.server import main

if __name__ == "__main__":
    main()
