"""Moved to :mod:`framework.engine.messages` (the engine process's IPC schema); the old name stays
importable for code written against it."""

from framework.engine.messages import (  # noqa: F401 - re-exported
    AbortRequests,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineReply,
    EngineRequest,
    GetStats,
    Heartbeat,
    LoadFailed,
    Ready,
    Shutdown,
    StatsReply,
    StepOutputs,
    TokenizerSpec,
)
