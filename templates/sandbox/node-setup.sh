#!/bin/sh
# Turns a bare Debian root filesystem into a sandbox node: what a fresh cloud instance has,
# and nothing more (no torch, MPI or rsync: installing those is the roles' job).
# Runs inside the image (Dockerfile RUN) or in a debootstrap chroot. Args: USER UID.
set -eu
user="${1:-debian}"
uid="${2:-1000}"

# A non-root login user with passwordless sudo, as cloud images have.
id "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash --uid "$uid" "$user"
printf '%s ALL=(ALL) NOPASSWD:ALL\n' "$user" > "/etc/sudoers.d/90-$user"
chmod 0440 "/etc/sudoers.d/90-$user"

# Each container generates its own host keys at start, so nodes never share one.
rm -f /etc/ssh/ssh_host_*
mkdir -p /run/sshd
# Containers may lack the audit capability pam_loginuid needs; don't let that end sessions.
sed -i 's/^session\s\+required\s\+pam_loginuid.so/session optional pam_loginuid.so/' /etc/pam.d/sshd
printf 'PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin no\n' \
  > /etc/ssh/sshd_config.d/10-nodeops-sandbox.conf

# Like a cloud image: apt indexes are fetched on first use, not shipped.
rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
