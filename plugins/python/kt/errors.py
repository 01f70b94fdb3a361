"""kt status codes as Python exceptions; each carries kt's own message."""


class KtError(RuntimeError):
    """A kt call failed. ``status`` is the kt_status value, ``status_name``
    its name, and the message is kt_last_error() of the failing call."""

    status = None

    def __init__(self, status, status_name, message):
        super().__init__("%s: %s" % (status_name, message))
        self.status = status
        self.status_name = status_name
        self.kt_message = message


class InvalidArgumentError(KtError, ValueError):
    pass


class NullPointerError(KtError, ValueError):
    pass


class InvalidHandleError(KtError):
    pass


class DTypeError(KtError, TypeError):
    pass


class ShapeError(KtError, ValueError):
    pass


class StrideError(KtError, ValueError):
    pass


class DeviceError(KtError, ValueError):
    pass


class ExpertIdError(KtError, IndexError):
    pass


class TooManyTokensError(KtError, ValueError):
    pass


class ContextError(KtError):
    pass


class NotBoundError(KtError):
    pass


class NotLoadedError(KtError):
    pass


class ModeError(KtError):
    pass


class UnsupportedError(KtError, NotImplementedError):
    pass


class OutOfMemoryError(KtError, MemoryError):
    pass


class IOFailure(KtError, OSError):
    pass


class InternalError(KtError):
    pass


class CommError(KtError):
    """A collective failed: a peer died, closed its connection or timed out."""


ERROR_CLASSES = {
    1: InvalidArgumentError, 2: NullPointerError, 3: InvalidHandleError, 4: DTypeError,
    5: ShapeError, 6: StrideError, 7: DeviceError, 8: ExpertIdError, 9: TooManyTokensError,
    10: ContextError, 11: NotBoundError, 12: NotLoadedError, 13: ModeError,
    14: UnsupportedError, 15: OutOfMemoryError, 16: IOFailure, 17: InternalError,
    18: CommError,
}
