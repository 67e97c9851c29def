import socket


def reachable(host: tuple[str, int], timeout: float = 3.0) -> bool:
    """Whether a TCP connection opens within `timeout` seconds: a quick offline check."""
    try:
        socket.create_connection(host, timeout=timeout).close()
        return True
    except OSError:
        return False
