"""``python -m services.tokenizer [--port N] [--model name@version] ...``: run the service."""

from services.tokenizer.server import main

if __name__ == "__main__":
    main()
