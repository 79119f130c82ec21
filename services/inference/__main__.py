"""``python -m services.inference``: run the inference service."""

from services.inference.server import main

if __name__ == "__main__":
    main()
