def bucket(step, cap_bytes):
    raise NotImplementedError
