"""`python -m pd_agent`: the in-pod agent's HTTP server."""
from .server import main

if __name__ == "__main__":
    main()
