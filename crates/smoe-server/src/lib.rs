//! smoe server.
