//! TLS termination (`server.tls`): rustls through Pingora, TLS 1.2 and 1.3,
//! with a certificate that a reload can swap. The listener asks
//! [`Certificate`] for the key of each handshake; a reload reads the files
//! again and swaps them in only when they parse and match, so a broken
//! certificate is a rejected reload and the old one keeps serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// `server.tls`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The TLS listeners.
    pub listen: Vec<std::net::SocketAddr>,
    /// The PEM certificate chain.
    pub cert_file: PathBuf,
    /// The PEM private key.
    pub key_file: PathBuf,
}

/// The served certificate, swapped whole on reload.
#[derive(Debug)]
pub struct Certificate {
    current: ArcSwap<CertifiedKey>,
}

impl Certificate {
    /// Reads the certificate chain and key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        Ok(Self {
            current: ArcSwap::from_pointee(certified_key(cert, key)?),
        })
    }

    /// Reads the files again; the old certificate stays when they do not
    /// make a valid pair.
    pub fn reload(&self, cert: &Path, key: &Path) -> Result<(), String> {
        self.current.store(Arc::new(certified_key(cert, key)?));
        Ok(())
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A certificate chain and its private key, checked to belong together.
fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", cert.display()));
    }
    let key_der =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
        .map_err(|e| format!("{}: {e}", key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))?;
    Ok(certified)
}
