//! SIGTERM and SIGINT as one future (DESIGN contract 9: SIGTERM runs the teardown).

/// Installs the handlers now (so a signal right after start is not lost) and returns a future that
/// resolves at the first SIGTERM or SIGINT, with the signal's name.
///
/// # Errors
/// The handler installation error.
pub fn terminated() -> std::io::Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}
